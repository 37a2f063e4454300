"""assembler"""
