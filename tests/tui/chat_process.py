"""The real chat in a process of its own (headless), for the tests that kill it.

Loads the offline pair, sends one message and lets the reply stream; the decoder is paced at
`STEP_SECONDS` a step (as a larger model would be) so that the test can kill the process mid-reply.
Usage: python -m tests.tui.chat_process TARGET DRAFT (the data folder comes from $FSD_CHAT_DATA_DIR).
The pair's folders come as arguments, not from tests.conftest, whose imports (pytest, the mapped
pairs' modeling) the chat does not need.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

from textual.pilot import Pilot

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.store import SessionStore
from fsd_chat.decoding import Controls, Decoder, DecodingSettings, Step
from fsd_chat.models.loading import load_pair
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.models.pair import ModelPair
from fsd_chat.support.config import sessions_path
from fsd_chat.tui.app import FsdChatApp
from tests.tui.helpers import SIZE, WrappedDecoder, wait_for_chat

PROMPT = "Once upon a time"
STEP_SECONDS = 0.05
SETTINGS = DecodingSettings(rule="fuzzy", divergence="js", threshold=0.1, draft_tokens=4)
MAX_NEW_TOKENS = 400


class PacedDecoder(WrappedDecoder):
    """The real speculative decoder, waiting `STEP_SECONDS` before each step."""

    def wrap(self, steps: Iterator[Step]) -> Iterator[Step]:
        """The inner decoder's steps, one every `STEP_SECONDS` at most."""
        for step in steps:
            time.sleep(STEP_SECONDS)
            yield step


def main() -> None:
    """Run the chat until a signal (or a test's kill) ends it; exit with the app's return code."""
    target, draft = sys.argv[1:3]
    pair: ModelPair = load_pair(
        ModelSpec(target), ModelSpec(draft), LoadOptions(device="cpu", dtype="float32")
    )
    options = ChatOptions(
        target=pair.target_spec,
        draft=pair.draft_spec,
        store=SessionStore(sessions_path()),
        settings=SETTINGS,
        max_new_tokens=MAX_NEW_TOKENS,
    )

    def factory(p: ModelPair, controls: Controls) -> Decoder:
        return PacedDecoder(p.speculative(controls))

    async def drive(pilot: Pilot[None]) -> None:
        await wait_for_chat(pilot)
        await pilot.press(*PROMPT, "enter")

    app = FsdChatApp(options, loader=lambda progress: pair, decoder_factory=factory)
    app.run(headless=True, size=SIZE, auto_pilot=drive)
    sys.exit(app.return_code or 0)


if __name__ == "__main__":
    main()
