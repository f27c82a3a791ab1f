"""fsd-chat: chat with local language models through Fuzzy Speculative Decoding."""

__version__ = "0.1.0"
