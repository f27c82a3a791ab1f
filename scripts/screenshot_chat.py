"""The README's screenshot (docs/chat.svg): the real chat over a real pair, a reply retuned while it
streams (T raised by `ctrl+up`), saved by Textual as SVG once the reply ends.

Offline pair by default; the timings on screen are this machine's:

    .venv/bin/python scripts/screenshot_chat.py --output docs/chat.svg
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from fsd_chat.conversation.controller import ChatOptions
from fsd_chat.conversation.store import SessionStore
from fsd_chat.models.options import LoadOptions, ModelSpec
from fsd_chat.tui.app import FsdChatApp
from fsd_chat.tui.screens.chat import ChatScreen

MODELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
PROMPT = "Once upon a time"
SIZE = (110, 32)


async def screenshot(options: ChatOptions, output: Path, raises: int, after: float) -> None:
    """Send PROMPT, raise T `raises` steps (as ctrl+up does) `after` seconds after sending, and save
    the screen once the reply ends."""
    app = FsdChatApp(options)
    async with app.run_test(size=SIZE) as pilot:
        while not isinstance(app.screen, ChatScreen):
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        screen = app.screen
        await pilot.press(*PROMPT)

        def retune() -> None:
            for _ in range(raises):
                screen.action_raise_threshold()  # what ctrl+up runs

        # A timer in the app's own loop: the pilot's key presses wait for the app to be idle, by
        # which time a short reply has ended.
        app.set_timer(after, retune)
        await pilot.press("enter")
        while screen.streaming is not None or not screen.session.turns:
            await asyncio.sleep(0.05)
        await pilot.pause(0.3)
        app.save_screenshot(output.name, str(output.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(MODELS / "stories260K"))
    parser.add_argument("--draft", default=str(MODELS / "stories260K-draft"))
    parser.add_argument("--output", type=Path, default=Path("docs/chat.svg"))
    parser.add_argument("--raises", type=int, default=6, help="ctrl+up presses mid-reply")
    parser.add_argument("--after", type=float, default=0.1, help="seconds into the reply to press them")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    options = ChatOptions(
        target=ModelSpec(args.target),
        draft=ModelSpec(args.draft),
        load=LoadOptions(device="cpu", dtype="float32"),
        store=SessionStore(folder / "sessions.sqlite3"),
        transcripts_dir=folder,
        threads=1,
    )
    asyncio.run(screenshot(options, args.output.resolve(), args.raises, args.after))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
