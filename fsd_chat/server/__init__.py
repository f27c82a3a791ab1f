"""`fsd-chat serve`: an OpenAI-compatible HTTP server over one model pair, with the dial per request
(`app`: the endpoints; `engine`: one reply decoding at a time, the rest queued; `schema`: the
request bodies; `errors`: OpenAI's error shape; `run`: binding, loading and uvicorn)."""
