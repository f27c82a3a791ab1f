"""Utilities every layer may use: errors, terminal-safe text, torch threads, the log, the user's
config file and paths."""
