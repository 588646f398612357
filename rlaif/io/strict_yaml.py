"""A YAML loader that refuses a mapping with one key twice (PyYAML keeps the last silently) and reads integers only
when written in decimal: configs, `--set` values, constitutions and the cluster settings, which the Airflow DAGs read
too (PyYAML only, no other rlaif dependency)."""
from __future__ import annotations

import re

import yaml

# YAML 1.1 reads 010 as octal 8, 12:30 as base-60 750 (1:30.5 as 90.5) and 0x1f as hex: a value is an integer only
# when written as plain decimal digits, a float never in base 60; otherwise it stays the text it was (a number
# setting then says it wants a number).
DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9_]*)")


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by the base class
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        return super().construct_yaml_int(node) if DECIMAL.fullmatch(text.strip()) else text

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node)
        return text if ":" in text else super().construct_yaml_float(node)  # base 60: 1:30.5 is not 90.5


UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)
UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", UniqueKeyLoader.construct_yaml_float)
