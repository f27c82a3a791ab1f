"""`python -m fsd_chat` runs the `fsd-chat` command."""

from fsd_chat.cli import main

main()
