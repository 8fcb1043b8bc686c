"""A checkpoint's own chat template, rendered as the model's users render it, but never trusted.

The template is `chat_template` in `tokenizer_config.json` (a string, or a list of named
templates of which `default` is used) or the file `chat_template.jinja`, as transformers reads
them. A template is Jinja code from whoever published the checkpoint: it is rendered in Jinja2's
immutable sandbox, as transformers does, and a template that reaches for a Python attribute
(`__class__`, `mro`, a method that mutates) is refused by name instead of rendering around it:
the sandbox's default answer, an empty value, would hide the attempt.
"""

from __future__ import annotations

import os
from typing import Callable

from eprt.errors import ConfigError
from eprt.storage.bounded import read_bounded, read_json_object
from eprt.storage.hf_files import CHAT_TEMPLATE, TOKENIZER_CONFIG
from eprt.storage.paths import resolve_inside
from eprt.storage.template_bounds import MAX_VALUE_CHARS

# a rendered conversation longer than this is refused: a template's loops cannot fill the memory
MAX_RENDERED_CHARS = MAX_VALUE_CHARS
MAX_TEMPLATE_BYTES = 1 << 20  # released templates are a few KiB


def checkpoint_file(hf_dir: str, name: str) -> str:
    """The path of the checkpoint's file `name`, once it is known to resolve inside `hf_dir`
    (eprt.storage.paths: a link out of the checkpoint is refused, as convert and export refuse it)."""
    return resolve_inside(hf_dir, name, f"{hf_dir} ({name})")


def template_source(hf_dir: str) -> tuple[str, str] | None:
    """(the template, where it was read) of the checkpoint in `hf_dir`, or None when it has none."""
    jinja = checkpoint_file(hf_dir, CHAT_TEMPLATE)
    if os.path.lexists(jinja):
        data = read_bounded(jinja, MAX_TEMPLATE_BYTES, "fix the template in the source checkpoint and convert again")
        try:
            return data.decode("utf-8"), jinja
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{jinja}: not UTF-8 text (byte {e.start}); fix the template in the source checkpoint and convert again"
            ) from None
    config_path = checkpoint_file(hf_dir, TOKENIZER_CONFIG)
    if not os.path.isfile(config_path):
        return None
    template = read_json_object(config_path, "fix the file in the source checkpoint and convert again").get(
        "chat_template"
    )
    if isinstance(template, list):  # named templates: the default one renders plain conversations
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ConfigError(
            f"{config_path}: chat_template is a {type(template).__name__}, not a template; fix the "
            "file in the source checkpoint and convert again"
        )
    return template, f"{config_path} (chat_template)"


def special_tokens(hf_dir: str) -> dict[str, str]:
    """The bos/eos/pad/unk token strings templates refer to, from tokenizer_config.json."""
    config_path = checkpoint_file(hf_dir, TOKENIZER_CONFIG)
    if not os.path.isfile(config_path):
        return {}
    config = read_json_object(config_path, "fix the file in the source checkpoint and convert again")
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            out[key] = token
    return out


def chat_renderer(hf_dir: str, data: str) -> Callable[[list, str], str]:
    """A function rendering one conversation (a list of messages, `where` naming it in errors)
    through the checkpoint's template; refused, naming `data` and the way out, when it has none."""
    found = template_source(hf_dir)
    if found is None:
        raise ConfigError(
            f"{data}: holds chat messages, but the checkpoint has no chat template (`chat_template` "
            f"in {TOKENIZER_CONFIG} or {CHAT_TEMPLATE} in {hf_dir}); add the model's template to the "
            'source checkpoint and convert again, or calibrate on plain text ({"text": ...})'
        )
    source, origin = found
    import jinja2
    from jinja2.sandbox import SecurityError

    from eprt.storage.template_bounds import Sandbox, Unbounded, deadline

    def raise_exception(message: str) -> None:  # templates call it to reject a conversation they cannot render
        raise jinja2.TemplateError(message)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(
            f"{origin}: not a valid Jinja template (line {e.lineno}: {e.message}); fix the template "
            "in the source checkpoint and convert again"
        ) from None
    tokens = special_tokens(hf_dir)

    def render(messages: list, where: str) -> str:
        pieces, size = [], 0
        try:  # streamed, so a template that loops out of bounds stops at the limit
            with deadline():
                for piece in template.generate(messages=messages, add_generation_prompt=False, **tokens):
                    size += len(piece)
                    if size > MAX_RENDERED_CHARS:
                        raise ConfigError(
                            f"{where}: the chat template of {origin} renders more than "
                            f"{MAX_RENDERED_CHARS} characters; split the conversation or fix the template"
                        )
                    pieces.append(piece)
        except (Unbounded, RecursionError) as e:
            what = e if isinstance(e, Unbounded) else "recursed past the interpreter's depth limit"
            raise ConfigError(
                f"{origin}: the chat template {what} while rendering {where}; refused: use the model's "
                "published template"
            ) from None
        except SecurityError as e:
            raise ConfigError(
                f"{origin}: the chat template tried to reach Python ({e}) while rendering {where}; "
                "refused: a template renders text and nothing else. Use the model's published "
                "template"
            ) from None
        except (jinja2.TemplateError, TypeError, ValueError, OverflowError) as e:
            raise ConfigError(
                f"{where}: the chat template of {origin} cannot render it ({type(e).__name__}: "
                f'{str(e)[:200]}); each message is {{"role": ..., "content": ...}}'
            ) from None
        return "".join(pieces)

    return render
