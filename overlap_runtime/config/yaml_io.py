"""YAML for configurations: safe types only, and a key repeated in one mapping is an error.

PyYAML keeps the last of two equal keys silently, so a file with two ``train:`` sections trains
with the second alone; :func:`load_yaml` refuses it, naming the key and both lines.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKeyError(ValueError):
    """A key appears twice in one YAML mapping (the message names it and both lines)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(f"{self.name}: the key {key!r} appears twice in one "
                                        f"mapping (lines {seen[key]} and {line}); YAML would "
                                        f"keep only the last one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str) -> Any:
    """``text`` parsed as YAML (safe types; ``source`` names it in errors).

    Raises:
        DuplicateKeyError: a key repeated in one mapping.
        yaml.YAMLError: not YAML.
    """
    loader = _UniqueKeyLoader(text)
    loader.name = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
