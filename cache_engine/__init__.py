"""cache_engine"""
