"""The conversation layer: a session and its turns, the fold from decoding steps to coloured runs,
the SQLite store and its writer thread, Markdown transcripts."""
