"""A failure's traceback as gpu-check's tests print it when it happens (MOE_KERNELS_INSTAFAIL=1,
python_tests/conftest.py), so a group stopped at its time limit still says why its failures failed."""


def instafail_text(text: str, limit: int = 4000) -> str:
    """`text` within about `limit` characters: each line cut to 400 (an assertion's tensor reprs run
    to tens of thousands on one line: the last 4000 characters of one were all a GPU run's log
    kept, without the assertion or its line), then its head and tail."""
    lines = [line if len(line) <= 400 else line[:400] + " ..." for line in text.splitlines()]
    text = "\n".join(lines)
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2 :]
