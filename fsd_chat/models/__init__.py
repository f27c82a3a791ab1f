"""The models layer: loading a target/draft pair (`loading`), saying in one line why a load failed
(`load_errors`), the loaded pair and its decoders (`pair`), what to load and where (`options`:
torch-free, so the command line and bench's reports start without torch), chat templates
(`chat_template`), GGUF files converted once into the user's cache (`gguf_files`; their header,
tensor types and identity: `gguf_table`) and the default chat model fetched from PyPI
(`default_model`, torch-free). Import from the submodules: this package imports none of them."""
