"""The chat TUI (Textual): `FsdChatApp` and its screens and widgets."""
