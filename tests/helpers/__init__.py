"""Builders and checks that several test modules share (a test module imports no other)."""
