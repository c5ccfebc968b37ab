"""selection"""
