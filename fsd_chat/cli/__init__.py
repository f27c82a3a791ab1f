"""The `fsd-chat` command line: the app and its entry point (`app`), one module a command (`chat`,
`generate`, `bench`), and the options they share (`options`)."""

from fsd_chat.cli.app import app, main

__all__ = ["app", "main"]
