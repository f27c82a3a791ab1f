"""Loading a target/draft pair on the engine `engine_choice` takes: llama.cpp for GGUF files
(`engine_choice.load_llama_cpp_pair`), else transformers (`transformers_loading`: device, dtype,
bitsandbytes quantization, compatibility).

Sources may be Hugging Face Hub ids (downloaded by transformers), local directories, or GGUF files
(`gguf_sources`: a `.gguf` path, a folder holding one, a Hub `repo_id:file.gguf`; on the
transformers engine converted to a folder in the user's cache on their first start, `gguf_files`).
Every failure becomes a `ModelLoadError` / `IncompatibleModelsError` / `DeviceMemoryError` with a
one-line message (`load_errors`)."""

from __future__ import annotations

from fsd_chat.models.engine_choice import TRANSFORMERS, choose_engine, load_llama_cpp_pair
from fsd_chat.models.gguf_sources import Progress as Progress  # re-exported: the TUI's loading screen
from fsd_chat.models.gguf_sources import on_stderr
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support import start_gc
from fsd_chat.support.log import quiet_transformers


def load_pair(
    target: ModelSpec,
    draft: ModelSpec,
    options: LoadOptions,
    progress: Progress | None = None,
) -> ModelPair:
    """Load and check a target/draft pair, on the engine `options.engine` chooses
    (`engine_choice.choose_engine`), and end a command's start (`start_gc.resume`). The choice and
    its reason are told to `progress` first; with no `progress`, for a GGUF target (where there was
    a choice), on stderr once the pair has loaded (so that a load that fails says so in one line).

    With several GPUs and `device` auto or cuda, the target is spread over them
    (`device_map="auto"`); the draft stays on the first.

    Args:
        target: The target model.
        draft: The draft model; source "lookup": none (drafts from prompt lookup).
        options: Device, dtype, trust_remote_code.
        progress: Called with a short description before each phase (None: none shown, but a GGUF
            file's first-start conversion is still announced, on stderr).

    Raises:
        ModelLoadError: either model or tokenizer fails to load.
        DeviceMemoryError: a model does not fit in GPU memory.
        IncompatibleModelsError: the draft's vocabulary cannot be mapped onto the target's, or
            its tokens cover too little of the target's probability mass (`check_coverage`).
        UnsupportedCacheError: a model on llama.cpp keeps recurrent state.
    """
    announce = progress or on_stderr  # a download or a slow first start is said on stderr
    choice = choose_engine(target, draft, options, announce)
    if progress is not None:
        progress(choice.describe())
    if choice.engine == TRANSFORMERS:
        # Imported here: transformers' modeling stack, which the llama.cpp engine does not use.
        quiet_transformers()
        from fsd_chat.models.transformers_loading import load_transformers_pair

        start_gc.resume()  # a conversion or a download takes long: it collects as it goes
        pair = load_transformers_pair(target, draft, options, progress)
    else:
        pair = load_llama_cpp_pair(choice, target, draft, options, progress)
        start_gc.resume()
    if progress is None and choice.target_is_gguf:
        on_stderr(choice.describe())
    return pair
