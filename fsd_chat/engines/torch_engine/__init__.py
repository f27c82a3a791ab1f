"""The transformers / torch engine behind the decoding loop's one seam
(`fsd_chat.decoding.runner.ModelRunner`)."""
