"""Prompt formatting: ``data.prompt_template`` for text prompts, the tokenizer's chat template
for message lists (``data.apply_chat_template``, ``data.system_prompt``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rljax.config import ConfigError

CHAT_MODES = ("auto", "true", "false")


def no_template_error(what: str) -> ConfigError:
    return ConfigError(
        f"{what}, but the tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
        "chat_template.jinja beside tokenizer.json); use the checkpoint's tokenizer files, or set "
        "data.apply_chat_template=false (message contents joined by blank lines)"
    )


def needs_chat_template(mode: str, is_chat: bool) -> bool:
    """Whether a prompt (a message list when ``is_chat``) is rendered by the chat template."""
    if mode not in CHAT_MODES:
        raise ConfigError(f"data.apply_chat_template={mode!r} is not accepted; accepted: {', '.join(CHAT_MODES)}")
    return mode == "true" or (mode == "auto" and is_chat)


class PromptFormatter:
    """``prompt (text or [{role, content}]) -> prompt text``.

    * text: ``template.format(prompt=text)``; with ``apply_chat_template=true`` the result is
      then the user message of a chat rendered by the chat template;
    * a message list: rendered by the chat template (``auto`` and ``true``; a generation prompt
      is added, as verl and TRL do) or, with ``false``, its contents joined by blank lines.

    ``system_prompt`` is put first as a system message of a chat that has none.

    Args:
      template: a format string with one ``{prompt}`` field.
      apply_chat_template: ``auto`` | ``true`` | ``false`` (``data.apply_chat_template``).
      system_prompt: ``data.system_prompt``.
      chat_template: ``messages -> text`` (the tokenizer's ``apply_chat_template``), None when
        the tokenizer has none.
    """

    def __init__(self, template: str = "{prompt}", *, apply_chat_template: str = "auto",
                 system_prompt: str | None = None,
                 chat_template: Callable[[Sequence[dict]], str] | None = None):
        needs_chat_template(apply_chat_template, False)  # validates the mode
        self.template, self.mode, self.system_prompt = template, apply_chat_template, system_prompt
        self.chat_template = chat_template

    def messages(self, prompt) -> list[dict]:
        msgs = [{"role": "user", "content": self.template.format(prompt=prompt)}] if isinstance(prompt, str) else \
            [dict(m) for m in prompt]
        if self.system_prompt is not None and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def __call__(self, prompt) -> str:
        is_chat = not isinstance(prompt, str)
        if not needs_chat_template(self.mode, is_chat):
            if is_chat:
                return "\n\n".join(str(m["content"]) for m in prompt)
            return self.template.format(prompt=prompt)
        if self.chat_template is None:
            raise no_template_error("the prompts are chat messages" if is_chat else "data.apply_chat_template=true")
        return self.chat_template(self.messages(prompt))
