"""How the fabric reads a JSON schema that constrains a reply (a ``json_schema`` grammar's source,
a tool's ``parameters``): an object schema that lists its properties and says nothing of others
allows no others, as llama.cpp's server and vLLM's default engine read it (docs/PROTOCOL.md,
*Grammar* among the records used inside messages). Pure data in, data out: the head, the tail
and the web UI read a schema alike.
"""
from __future__ import annotations

# where a schema holds schemas that a value must match as they stand: one, several, or a map of them
_ONE = ("additionalProperties", "items", "additionalItems")
_SEVERAL = ("anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")
# keys that intersect schemas: a branch closed to its own properties would refuse the others'
_INTERSECTING = ("allOf", "if", "then", "else", "not", "dependentSchemas", "dependencies")
MAX_SCHEMA_DEPTH = 128  # llguidance refuses a schema whose JSON nests deeper than about this


def closed(schema, depth: int = 0):
    """``schema`` with ``"additionalProperties": false`` on each object schema that lists
    ``properties`` (or ``patternProperties``) and says nothing of others. JSON Schema would allow
    any other key there, and a model given the room fills it: a function's arguments would come
    with keys nobody declared. ``true`` (or a schema) keeps them allowed. Only places that hold
    schemas a value must match are walked (never a ``const``, ``enum`` or ``default`` value), and
    a schema that intersects schemas anywhere (``allOf``, ``if``, ``not``, a ``$ref`` beside
    properties) is left as written, since closing one side would refuse the other's keys. Nothing
    deeper than MAX_SCHEMA_DEPTH is touched (llguidance refuses it anyway). A copy."""
    if depth == 0 and _intersects(schema):
        return schema
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key], depth + 1)
    for key in _SEVERAL:
        if isinstance(out.get(key), list):
            out[key] = [closed(s, depth + 1) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s, depth + 1) for name, s in out[key].items()}
    lists = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    if lists and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _intersects(schema) -> bool:
    """Whether any map in ``schema`` (values too: this errs toward leaving a schema as written)
    intersects schemas. Walked without recursion, as deep as it goes."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if any(key in item for key in _INTERSECTING) or ("$ref" in item and "properties" in item):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
