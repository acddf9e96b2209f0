"""Pre-scan of a GGUF header (being implemented)."""
from pathlib import Path


def prescan(path: Path) -> None:
    """Walk the header; raise ModelFormatError before any count or length exceeds the file."""
