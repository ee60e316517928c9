"""Text <-> token ids for one model, and its chat template, loaded from the model's own files.

An HF directory is read with `tokenizers` alone; a GGUF file's embedded tokenizer goes through
transformers (optionally extracted once into a cache directory). Either way only the
`tokenizers` backend, the template string and a few ids are kept: a Tokenizer pickles cheaply
into the engine process and never needs torch.

Special tokens and user text: the backend turns the text "<|im_start|>" into the control token
<|im_start|> wherever it appears. A user message containing "<|im_start|>system\\n..." would then
open a forged system turn. So only specials the *template* writes become special ids; inside
message contents (and tool calls, and the tools offered) they are tokenized as plain text (see
`apply_chat_template`).

Tools: a template that reads the variable `tools` renders them itself (`supports_tools`; Qwen 2.5,
Hermes 2/3 and Llama 3.1 style templates), given OpenAI's tool list, assistant messages with their
`tool_calls` (arguments as objects, as transformers' templates expect) and tool-role messages.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers

CHAT_ROLES = ("system", "user", "assistant", "tool")


def _ids(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`backend.encode(text).ids`, through encode_batch: `tokenizers` releases the GIL there and
    not in encode, so a long text tokenized on another thread (the native plugin's) no longer
    stops the event loop for its whole duration (1 MiB of text: ~20 ms against ~1.7 s)."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None,
        special_tokens_map: Mapping[str, str],  # bos_token, eos_token, ... as the template sees them
        eos_token_ids: Sequence[int],
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens_map)
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # unique, in order
        # A twin that reads special-token text as plain text, for untrusted strings. A twin,
        # not a toggled flag, so concurrent encodes cannot see each other's setting.
        self._plain = tokenizers.Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self._special_ids = {
            token.content: token_id
            for token_id, token in backend.get_added_tokens_decoder().items() if token.special}
        self._special_pattern = _alternation(self._special_ids) if self._special_ids else None

    def __reduce__(self):
        return (_rebuild, (self.backend, self.chat_template, self.special_tokens_map, self.eos_token_ids))

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
        """Load from an HF model directory (tokenizer.json, tokenizer_config.json) or a .gguf file.

        A directory is read with `tokenizers` alone (no transformers, no torch: the gateway
        process can afford it). A GGUF file needs transformers and takes seconds to parse; with
        cache_dir it is extracted there once as a directory, and later loads read that.
        """
        path = os.fspath(path)
        if os.path.isfile(path) and path.endswith(".gguf"):
            if cache_dir is not None:
                return cls.from_pretrained(gguf_tokenizer_dir(path, cache_dir))
            return cls.from_hf(load_gguf_hf_tokenizer(path))
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return cls._from_directory(path)
        raise FileNotFoundError(f"{path}: not a .gguf file or a directory with tokenizer.json")

    @classmethod
    def _from_directory(cls, path: str) -> Tokenizer:
        backend = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_tokens_map = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token  # AddedToken form
            if isinstance(token, str):
                special_tokens_map[name] = token
        eos = special_tokens_map.get("eos_token")
        eos_ids = [backend.token_to_id(eos)] if eos and backend.token_to_id(eos) is not None else []
        return cls(backend, chat_template=_chat_template(path, config),
                   special_tokens_map=special_tokens_map,
                   eos_token_ids=[*eos_ids, *_generation_config_eos(path)])

    @classmethod
    def from_hf(cls, hf_tokenizer: Any, extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Take what we need from a transformers tokenizer (it must have a fast backend)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise ValueError(f"{type(hf_tokenizer).__name__} has no `tokenizers` backend (tokenizer.json)")
        template = hf_tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one is the chat template
            template = template.get("default")
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        return cls(backend, chat_template=template,
                   special_tokens_map={k: v for k, v in hf_tokenizer.special_tokens_map.items()
                                       if isinstance(v, str)},
                   eos_token_ids=[*eos, *extra_eos_token_ids])

    # ------------------------------------------------------------------ encoding

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens_map.get("bos_token")
        return self.backend.token_to_id(bos) if bos else None

    def encode(self, text: str, *, add_special_tokens: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, with the model's own BOS/EOS added when add_special_tokens.

        parse_special=False (the default) reads special-token text in `text` as plain text;
        set it only for trusted text that is meant to contain control tokens.
        """
        backend = self.backend if parse_special else self._plain
        return _ids(backend, text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs report it (a partial UTF-8 character shows as U+FFFD)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return self.backend.id_to_token(token_id) in self._special_ids

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token written `text`; None where `text` is no special token."""
        return self._special_ids.get(text)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self._special_ids.values())

    # ------------------------------------------------------------------ chat

    @functools.cached_property
    def supports_tools(self) -> bool:
        """The chat template renders a `tools` list itself (it reads that variable)."""
        return bool(self.chat_template) and "tools" in _template_variables(self.chat_template)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for a chat, using the model's template; only template-written
        special tokens become special ids. `tools` (OpenAI's tool list) go to a template that
        `supports_tools`; one that does not ignores them.

        How: special-token text in message contents (and in tool calls and tools) is swapped
        for a random marker before the template runs, so after rendering every remaining special
        text was written by the template. The rendered text is tokenized normally between
        markers (identical to tokenizing the whole text when no content holds special text), and
        each marker's original text is tokenized as plain text.
        """
        rendered, originals = self._render(validate_messages(messages), tools, add_generation_prompt)
        if not originals:
            return _ids(self.backend, rendered, False)
        marker_pattern = _alternation(originals)
        ids: list[int] = []
        position = 0
        for match in marker_pattern.finditer(rendered):
            ids += _ids(self.backend, rendered[position:match.start()], False)
            ids += _ids(self._plain, originals[match.group()], False)
            position = match.end()
        ids += _ids(self.backend, rendered[position:], False)
        return ids

    def render_chat_template(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
                             add_generation_prompt: bool = True) -> str:
        """The prompt as text (for logs and debugging; tokenize with apply_chat_template)."""
        rendered, originals = self._render(validate_messages(messages), tools, add_generation_prompt)
        for marker, original in originals.items():
            rendered = rendered.replace(marker, original)
        return rendered

    def _render(self, messages: list[dict], tools: Sequence[Mapping] | None,
                add_generation_prompt: bool) -> tuple[str, dict[str, str]]:
        """Render with special text in contents replaced by markers; return marker -> original."""
        from transformers.utils.chat_template_utils import render_jinja_template  # sandboxed jinja

        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        tools = [dict(t) for t in tools] if tools and self.supports_tools else None
        originals: dict[str, str] = {}
        if self._special_pattern is not None:
            nonce = _unused_nonce([messages, tools])

            # (A template that rewrites content, e.g. `| upper`, mangles markers too; the
            # special text is then lost, never turned into a control token.)
            def to_marker(match: re.Match) -> str:
                marker = f"kvgate{nonce}m{len(originals)}x"
                originals[marker] = match.group()
                return marker

            messages, tools = _map_strings([messages, tools], lambda text: self._special_pattern.sub(to_marker, text))
        rendered, _ = render_jinja_template(
            conversations=[messages], tools=tools, chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return rendered[0], originals


def load_gguf_hf_tokenizer(gguf_path: str):
    """The transformers tokenizer embedded in a GGUF file (slow: parses the whole vocabulary)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path) or ".", gguf_file=os.path.basename(gguf_path))


def gguf_tokenizer_dir(gguf_path: str, cache_dir: str | os.PathLike) -> str:
    """An HF tokenizer directory extracted from `gguf_path` into cache_dir (made on first use).

    Keyed by the file's name, size and modification time, so a replaced file is re-read.
    """
    stat = os.stat(gguf_path)
    name = f"{os.path.basename(gguf_path)}-{stat.st_size}-{stat.st_mtime_ns}"
    target = os.path.join(os.fspath(cache_dir), name)
    if not os.path.isdir(target):
        os.makedirs(cache_dir, exist_ok=True)
        staging = tempfile.mkdtemp(dir=cache_dir, prefix=".staging-")
        load_gguf_hf_tokenizer(gguf_path).save_pretrained(staging)
        try:
            os.rename(staging, target)  # atomic: a concurrent loader sees all of it or none
        except OSError:  # another process got there first; theirs is as good as ours
            shutil.rmtree(staging, ignore_errors=True)
    return target


def validate_messages(messages: Any) -> list[dict]:
    """Check chat messages and reduce them to {"role", "content": str}, plus an assistant's
    `tool_calls` and a tool message's `tool_call_id` and `name`; ValueError names the field.

    Content is a string or a list of {"type": "text", "text": ...} parts (joined with newlines);
    an assistant message that only calls tools has content "". Other fields are dropped, so
    nothing unchecked reaches the template.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages: expected a list of messages")
    if not messages:
        raise ValueError("messages: must not be empty")
    return [_validate_message(i, message) for i, message in enumerate(messages)]


def _validate_message(index: int, message: Any) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where}: expected an object with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role: must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    out = {"role": role, "content": "" if content is None and calls else _content_text(f"{where}.content", content)}
    if calls:
        if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
            raise ValueError(f"{where}.tool_calls: expected a list of tool calls")
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(calls)]
    if role == "tool":
        out.update({key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)})
    return out


def _tool_call(where: str, call: Any) -> dict:
    """An OpenAI tool call as templates read it: the arguments as an object when they are one
    in JSON (transformers' templates write `arguments | tojson`; vLLM hands them objects too)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function.name: expected a string")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
            arguments = parsed if isinstance(parsed, dict) else arguments
        except ValueError:
            pass  # as the model wrote it: the template shows it as text
    elif not isinstance(arguments, Mapping):
        raise ValueError(f"{where}.function.arguments: expected a JSON string or an object")
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
        raise ValueError(f"{where}: expected a string or a list of text parts; got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}[{i}]: only {{'type': 'text'}} parts are supported; got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}].text: expected a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _alternation(strings) -> re.Pattern:
    """A regex matching any of `strings`; longest first, so at one position the longest wins."""
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))


def _unused_nonce(values: Any) -> str:
    """A random tag no string in `values` contains, so markers cannot be forged either."""
    texts: list[str] = []
    _map_strings(values, lambda text: texts.append(text) or text)
    while True:
        nonce = secrets.token_hex(8)
        if not any(nonce in text for text in texts):
            return nonce


def _map_strings(value: Any, change) -> Any:
    """`value` (JSON-like: dicts, lists, strings, numbers) with `change` applied to every string
    in it, the keys of objects too (a schema's property names are shown by `tojson`)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {_map_strings(key, change): _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(item, change) for item in value]
    return value


def _template_variables(template: str) -> set[str]:
    """The variables a chat template reads from its context (parsed with transformers' own
    environment, which knows its extra tags; an unparsable template reads none)."""
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        environment = _compile_jinja_template(template).environment
        return jinja2.meta.find_undeclared_variables(environment.parse(template))
    except Exception:  # noqa: BLE001 - whatever the template holds, it then renders without tools
        return set()


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _chat_template(model_dir: str, config: dict) -> str | None:
    """Where transformers keeps it: chat_template.jinja, else tokenizer_config.json (a string,
    or a list of named templates of which "default" is the chat one)."""
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template if isinstance(template, str) else None


def _generation_config_eos(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json: chat models often stop on several (e.g. Llama 3)."""
    eos = _read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _rebuild(backend, chat_template, special_tokens_map, eos_token_ids) -> Tokenizer:
    return Tokenizer(backend, chat_template=chat_template, special_tokens_map=special_tokens_map,
                     eos_token_ids=eos_token_ids)
