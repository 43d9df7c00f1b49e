"""The README's API example runs as written (docs that drift from the code are a bug)."""

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_example_runs():
    text = README.read_text()
    start = text.index("```python", text.index("## API")) + len("```python")
    code = text[start : text.index("```", start)]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["y"].shape == (4096, 512)
    assert namespace["out"].shape == (8, 128, 512)
