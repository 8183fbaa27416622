"""Presentation shared by commands and reports: terminal tables."""
