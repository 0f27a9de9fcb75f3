"""keel.serve.openai.required_calls: the calls of a tool_choice "required" output, read piece by piece."""

from __future__ import annotations

import json

import pytest

from keel.serve.openai.required_calls import RequiredCalls

OUTPUT = (
    '[ {"name": "get_weather", "parameters": {"city": "Z\\u00fcrich \\"centre\\"", "days": [1, 2], "unit": "c"}},\n'
    '  {"name": "get_time" ,"parameters" : {} }, {"name": "no\\\\args", "parameters": {"x": {"y": "}]"}}}]'
)


def read(pieces: list[str]) -> tuple[list[str], list[str], list[tuple[int, str | None, str]]]:
    reader = RequiredCalls()
    updates = [(u.index, u.name, u.arguments) for piece in pieces for u in reader.feed(piece)]
    return reader.names, reader.arguments, updates


def test_whole_output_gives_each_call_and_its_arguments_as_generated():
    names, arguments, _ = read([OUTPUT])
    assert names == ["get_weather", "get_time", "no\\args"]
    assert arguments == [
        '{"city": "Z\\u00fcrich \\"centre\\"", "days": [1, 2], "unit": "c"}',
        "{}",
        '{"x": {"y": "}]"}}',
    ]
    assert [json.loads(a) for a in arguments] == [p["parameters"] for p in json.loads(OUTPUT)]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_any_split_gives_the_same_calls_and_pieces_that_add_up(size):
    whole_names, whole_arguments, _ = read([OUTPUT])
    names, arguments, updates = read([OUTPUT[i : i + size] for i in range(0, len(OUTPUT), size)])
    assert (names, arguments) == (whole_names, whole_arguments)
    starts = [(index, name) for index, name, _ in updates if name is not None]
    assert starts == list(enumerate(whole_names))  # each call announced once, in order, before its arguments
    for index, expected in enumerate(whole_arguments):
        assert "".join(a for i, _, a in updates if i == index) == expected


def test_a_cut_output_streams_what_came():
    cut = OUTPUT[: OUTPUT.index('"days"') + 3]
    names, arguments, _ = read([cut])
    assert names == ["get_weather"] and arguments == ['{"city": "Z\\u00fcrich \\"centre\\"", "da']
    assert read(['[{"name": "get_w'])[0] == []  # no call before its name is whole


def test_parameters_before_the_name_wait_for_it():
    names, arguments, updates = read(['[{"parameters": {"a": ', '1}, "name": "f"}]'])
    assert names == ["f"] and arguments == ['{"a": 1}'] and updates == [(0, "f", '{"a": 1}')]
    assert RequiredCalls().closed is False
    reader = RequiredCalls()
    reader.feed(OUTPUT)
    assert reader.closed
