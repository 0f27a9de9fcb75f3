"""Chat requests as prompts (keel.serve.openai.chat_prompt): template variables, continue_final_message,
add_special_tokens, tool calls kept for the template; without a model."""

from __future__ import annotations

import pytest

from keel.serve.openai.chat_prompt import render_chat, render_chat_text
from keel.serve.openai.errors import APIError
from keel.serve.openai.protocol import ChatCompletionRequest

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}"
    "{% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}[/end]{% endfor %}"
    "{% if tools %}<tools {{ tools | map(attribute='function.name') | join(',') }}>{% endif %}"
    "{% if persona %}<persona {{ persona }}>{% endif %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


class RecordingTokenizer:
    """apply_chat_template as keel's Tokenizer renders it; encode records add_special_tokens."""

    def __init__(self) -> None:
        from keel.tokenizer import _compile_template

        self.template = _compile_template(TEMPLATE)
        self.calls: list[bool] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(add_special_tokens)
        return [ord(c) for c in text] + ([0] if add_special_tokens else [])


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_add_special_tokens_reaches_the_tokenizer():
    tok = RecordingTokenizer()
    plain, special = render_chat(tok, request()), render_chat(tok, request(add_special_tokens=True))
    assert tok.calls == [False, True] and special == plain + [0]


def test_template_variables_tools_and_kwargs():
    tok = RecordingTokenizer()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    text = render_chat_text(tok, request(tools=tools, chat_template_kwargs={"persona": "Ann"}))
    assert text == "[user]hi[/end]<tools f><persona Ann>[assistant]"
    with pytest.raises(APIError) as e:
        render_chat_text(tok, request(chat_template_kwargs={"messages": []}))
    assert e.value.param == "chat_template_kwargs"


def test_tool_calls_and_tool_results_reach_the_template():
    tok = RecordingTokenizer()
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    text = render_chat_text(tok, request(messages=messages))
    assert text == "[user]hi[/end][assistant]<call weather Oslo>[/end][tool]cold<for c1>[/end][assistant]"
    bad = [*messages[:1], {"role": "assistant", "tool_calls": [{**call, "function": {"name": "w", "arguments": "{"}}]}]
    with pytest.raises(APIError, match="not JSON"):
        render_chat_text(tok, request(messages=bad))


def test_continue_final_message_cuts_after_its_content():
    tok = RecordingTokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    text = render_chat_text(tok, request(messages=messages, add_generation_prompt=False, continue_final_message=True))
    assert text == "[user]hi[/end][assistant]Once upon"
    with pytest.raises(APIError) as e:
        render_chat_text(tok, request(messages=messages, continue_final_message=True))
    assert e.value.param == "continue_final_message"
