"""
Config overrides, nanoGPT style, without magic beyond exec.

    python train.py config/quickstart.py --max_steps=50 --crop=(64,64,64)

train.py keeps its defaults as plain module globals. apply() runs each config file (plain Python that
assigns globals) and then each --key=value, in command-line order, and checks every change:
  * the key must already exist in train.py (a typo must not silently do nothing);
  * the value must have the default's type (an int is accepted where a float is expected).
Values are parsed with ast.literal_eval, so --crop=(64,64,64) is a tuple and --data_paths=['a','b'] a
list; a value that does not parse is taken as a string (--out_dir=out/run1).
"""

import ast
import os


class ConfigError(ValueError):
    """A bad override: the message names the key and the fix."""


def _check(cfg, key, value, where):
    if key not in cfg:
        close = [k for k in cfg if k.split("_")[0] == key.split("_")[0]][:5]
        raise ConfigError(f"unknown config key {key!r} ({where}); known keys like it: {close or sorted(cfg)[:10]}")
    default = cfg[key]
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if default is not None and type(value) is not type(default):
        raise ConfigError(f"config key {key!r} ({where}) must be {type(default).__name__} like its default "
                          f"{default!r}, got {type(value).__name__} {value!r}")
    return value


def apply(cfg, argv):
    """Apply config files and --key=value overrides in `argv` to the dict `cfg` (train.py's globals, or
    a plain dict of the config keys). Returns the dict of keys that were changed."""
    changed = {}
    for arg in argv:
        if not arg.startswith("--"):
            # a config file: run it in a scratch namespace, then check what it assigned
            try:
                src = open(arg).read()
            except OSError as e:
                raise ConfigError(f"cannot read config file {arg!r}: {e}") from e
            scope = {"__file__": arg}  # so that a config can build on another one beside it (config/context_1m.py)
            exec(compile(src, arg, "exec"), scope)
            for key, value in scope.items():
                if key.startswith("__") or callable(value) or type(value).__name__ == "module":
                    continue  # imports and helper functions a config file may use
                changed[key] = cfg[key] = _check(cfg, key, value, f"in {arg}")
        else:
            if "=" not in arg:
                raise ConfigError(f"override {arg!r} must look like --key=value")
            key, text = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare string
            changed[key] = cfg[key] = _check(cfg, key, value, f"from {arg}")
    return changed


def defaults(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")):
    """train.py's config defaults as a dict, read from its source without importing it: the block of plain
    assignments from the line '# config: defaults' to 'CONFIG_KEYS = ...', run as a config file is. For the
    files that train.py imports and that need its defaults on their own command line (plan.py): importing
    train.py there would close an import circle."""
    src = open(path).read()
    block = src[src.index("# config: defaults"):src.index("CONFIG_KEYS = ")]
    scope = {}
    exec(compile(block, path, "exec"), scope)
    return {k: v for k, v in scope.items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str, tuple, list))}
