"""Screens: loading, chat, help and the export dialog."""
