"""Harnesses and factories shared by the tests."""
