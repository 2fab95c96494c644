"""Adversarial parity review of chat rendering: kvfit's LLM.chat, /v1/chat/completions and /tokenize (through
server.prepare, the code the handlers run) against transformers' apply_chat_template(tokenize=True) called the
way vLLM 0.26 calls it (its message parsing: content format string/openai, tool_call arguments parsed to objects,
reasoning fields, developer -> system), on realistic templates (Llama 3.1/3.2, Qwen3, Qwen2.5, Mistral v0.3,
Phi-3, Gemma, Gemma 3, ChatML) and a tiny llama whose tokenizer knows their control tokens.

Each test once exposed a divergence that is fixed now, or pins what already matched; a `chat_template_kwargs` naming
add_generation_prompt stays a 400 (vLLM lets the request field win silently)."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest

from kvfit.errors import RequestError
from kvfit.server.prepare import PrepareContext, prepare_request
from kvfit.server.protocol import APIError, ChatCompletionRequest, TokenizeRequest
from kvfit.text.chat_template import load_chat_template
from kvfit.text.tokenizer import load_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))

# ---------------------------------------------------------------------------------------------------------------
# templates (close to the shipped ones)
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Llama 3.2 style: date from strftime_now
LLAMA32_DATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

MISTRAL_V03 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

PHI3 = r"""{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>
' + message['content'] + '<|end|>
'}}{% elif message['role'] == 'user' %}{{'<|user|>
' + message['content'] + '<|end|>
'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>
' + message['content'] + '<|end|>
'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>
' }}{% else %}{{ eos_token }}{% endif %}"""

GEMMA = r"""{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '
' + message['content'] | trim + '<end_of_turn>
' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model
'}}{% endif %}"""

# Gemma 3 style: iterates over content parts (vLLM detects "openai" content format)
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""

CHATML = r"""{% for message in messages %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""

# misc: loop.last, namespace, tojson args, `is string`, documents
MISC = r"""{%- set ns = namespace(sys='', n=0) -%}
{%- if messages[0]['content'] is string and messages[0]['role'] == 'system' -%}{%- set ns.sys = messages[0]['content'] -%}{%- endif -%}
<s>[SYS]{{ ns.sys }}[/SYS]
{%- if tools -%}[TOOLS]{{ tools | tojson(indent=2, ensure_ascii=True) }}[/TOOLS]{%- endif -%}
{%- if documents -%}{%- for d in documents -%}[DOC {{ loop.index }}]{{ d.title }}: {{ d.text }}{%- endfor -%}{%- endif -%}
{%- for m in messages if m.role != 'system' -%}
{%- set ns.n = ns.n + 1 -%}
[{{ m.role | upper }} {{ ns.n }}]{{ m.content }}{% if m.name is defined %}({{ m.name }}){% endif %}{% if not loop.last %}|{% endif %}
{%- endfor -%}
{%- if add_generation_prompt -%}[ASSISTANT]{%- endif -%}"""


# ---------------------------------------------------------------------------------------------------------------
# the model folder: a tiny llama whose tokenizer has the control tokens above as special (or plain added) tokens
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
            "<|python_tag|>", "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]", "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<|system|>",
            "<|user|>", "<|assistant|>", "<|end|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=2048, block_size=16, max_num_seqs=8,
              max_num_batched_tokens=2048, num_gpu_blocks_override=256)


def build_folder(folder: str, template: str | None = CHATML, extra_config: dict | None = None,
                 weights: bool = False) -> str:
    import torch
    import transformers
    from tokenizers import AddedToken, processors
    from tiny_models import BOS, EOS, UNK, train_tokenizer
    os.makedirs(folder, exist_ok=True)
    tok = train_tokenizer(320, add_bos=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in PLAIN_ADDED])
    # the post-processor adds a bos (as Llama's): a chat must not get it (vLLM: add_special_tokens=False)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
              "model_max_length": 4096, "clean_up_tokenization_spaces": False, **(extra_config or {})}
    if template is not None:
        config["chat_template"] = template
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    hf_config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    if weights:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(folder)
        with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as fh:
            json.dump({"bos_token_id": 1, "eos_token_id": 2}, fh)
    else:
        hf_config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_folder(str(tmp_path_factory.mktemp("chatreview") / "tiny"), weights=True)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def ours(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def llm(folder):
    from kvfit import LLM
    engine = LLM(folder, **ENGINE)
    yield engine
    engine.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# vLLM 0.26's message handling (entrypoints/chat_utils.py, renderers/hf.py), then transformers renders


def _has_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def vllm_conversation(messages: list[dict], template: str, content_format: str = "string",
                      server: bool = True) -> list[dict]:
    """The messages as vLLM hands them to tokenizer.apply_chat_template."""
    conversation = []
    for message in copy.deepcopy(messages):
        if server:          # ChatCompletionRequest._normalize_messages_before
            legacy = message.pop("reasoning_content", None)
            if legacy is not None and message.get("reasoning") is None:
                message["reasoning"] = legacy
        role, content = message["role"], message.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts = [p if isinstance(p, str) else p.get("text", p.get("refusal")) for p in parts]
        out = {"role": role,
               "content": [{"type": "text", "text": t} for t in texts] if content_format == "openai"
               else "\n".join(texts)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                out["tool_calls"] = list(message["tool_calls"])
            if message.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                out["tool_call_id"] = message["tool_call_id"]
            if isinstance(out["content"], list):
                out["content"] = "\n".join(p["text"] for p in out["content"])
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        conversation.append(out)
    for message in conversation:                # _postprocess_messages
        if message["role"] == "assistant" and "tool_calls" in message:
            if not message["tool_calls"]:
                message.pop("tool_calls")
                continue
            for call in message["tool_calls"]:
                arguments = call["function"].get("arguments")
                if arguments:
                    if not isinstance(arguments, (dict, list)):
                        parsed = json.loads(arguments)
                        call["function"]["arguments"] = parsed if parsed is not None else {}
                else:
                    call["function"]["arguments"] = {}
    if any(m["role"] == "developer" for m in conversation) and not _has_developer(template):
        conversation = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conversation]
        systems = [i for i, m in enumerate(conversation) if m["role"] == "system"]
        if systems and (systems[0] > 0 or len(systems) > 1):
            texts = [m["content"] if isinstance(m["content"], str) else "\n".join(p["text"] for p in m["content"])
                     for m in conversation if m["role"] == "system"]
            conversation = [{"role": "system", "content": "\n\n".join(t for t in texts if t)},
                            *[m for m in conversation if m["role"] != "system"]]
    return conversation


def vllm_ids(hf, messages, template, *, content_format="string", server=True, tools=None,
             add_generation_prompt=True, continue_final_message=False, **kwargs) -> list[int]:
    conversation = vllm_conversation(messages, template, content_format, server)
    return list(hf.apply_chat_template(conversation, tools=tools, chat_template=template, tokenize=True,
                                       return_dict=False, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **kwargs))


def server_ids(ours, body: dict, template: str | None, content_format: str = "auto",
               model_class=ChatCompletionRequest) -> list[int]:
    """prompt token ids of a chat (or /tokenize) body as the server prepares it, with --chat-template template."""
    context = PrepareContext(("m",), template, 10**7, 2048, content_format)
    return prepare_request(json.dumps(body).encode(), model_class, context, ours, {}).prompt_ids


def server_error(ours, body: dict, template: str | None) -> APIError:
    with pytest.raises(APIError) as info:
        server_ids(ours, body, template)
    return info.value


def llm_ids(llm, messages, **kwargs) -> list[int]:
    from kvfit import SamplingParams
    return llm.chat(messages, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False, **kwargs)[0].prompt_token_ids


# ---------------------------------------------------------------------------------------------------------------
# conversations

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville <b>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SYSTEM_CHAT = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello there"},
               {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "What's 2+2?"}]
USER_CHAT = SYSTEM_CHAT[1:]
OPEN_ASSISTANT = [{"role": "assistant", "content": "The answer is"}]


def tool_chat(call_id: str = "abcDEF123") -> list[dict]:
    return [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "°C"}'}}]},
            {"role": "tool", "content": "sunny, 21", "tool_call_id": call_id},
            {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks!"}]


# (name, template, chat, whether the template takes tools)
FAMILIES = [("llama3.1", LLAMA31, SYSTEM_CHAT, True), ("llama3.2-strftime", LLAMA32_DATE, SYSTEM_CHAT, False),
            ("qwen3", QWEN3, SYSTEM_CHAT, True), ("qwen2.5", QWEN25, SYSTEM_CHAT, True),
            ("mistral-v0.3", MISTRAL_V03, SYSTEM_CHAT, True), ("phi3", PHI3, SYSTEM_CHAT, False),
            ("gemma", GEMMA, USER_CHAT, False), ("chatml", CHATML, SYSTEM_CHAT, False),
            ("misc", MISC, SYSTEM_CHAT, True)]
FAMILY_IDS = [f[0] for f in FAMILIES]
SCENARIOS = ["generation-prompt", "no-generation-prompt", "continue-final-message", "tools-history"]
CASES = [(f, s) for f in FAMILIES for s in SCENARIOS if f[3] or s != "tools-history"]
CASE_IDS = [f"{f[0]}-{s}" for f, s in CASES]


def _scenario(family, scenario):
    _, template, chat, _ = family
    if scenario == "generation-prompt":
        return chat, {}
    if scenario == "no-generation-prompt":
        return chat[:-1], {"add_generation_prompt": False}
    if scenario == "continue-final-message":
        return chat[:-1] + OPEN_ASSISTANT if chat[-2]["role"] == "user" else chat[:-2] + OPEN_ASSISTANT, \
            {"add_generation_prompt": False, "continue_final_message": True}
    return tool_chat(), {"tools": TOOLS}


# ---------------------------------------------------------------------------------------------------------------
# parity that holds today


@pytest.mark.parametrize("family, scenario", CASES, ids=CASE_IDS)
def test_server_chat_ids_equal_vllm(hf, ours, family, scenario):
    messages, options = _scenario(family, scenario)
    template = family[1]
    expected = vllm_ids(hf, messages, template, **options)
    body = {"messages": messages, **options}
    assert server_ids(ours, body, template) == expected
    # /tokenize with messages renders the same ids (add_special_tokens defaults to false there)
    assert server_ids(ours, body, template, model_class=TokenizeRequest) == expected


@pytest.mark.parametrize("family, scenario", CASES, ids=CASE_IDS)
def test_llm_chat_ids_equal_vllm(hf, llm, family, scenario):
    messages, options = _scenario(family, scenario)
    template = family[1]
    expected = vllm_ids(hf, messages, template, server=False, **options)
    assert llm_ids(llm, messages, chat_template=template, **options) == expected


def test_bos_written_by_the_template_is_the_only_bos(hf, ours, llm):
    bos = ours.bos_token_id
    for template in (LLAMA31, GEMMA, MISTRAL_V03):          # write {{ bos_token }} themselves
        ids = server_ids(ours, {"messages": USER_CHAT}, template)
        assert ids.count(bos) == 1 and ids[0] == bos
        assert llm_ids(llm, USER_CHAT, chat_template=template).count(bos) == 1
    for template in (CHATML, QWEN3, PHI3):                   # write none: none is added (the tokenizer would add one)
        assert bos not in server_ids(ours, {"messages": USER_CHAT}, template)
        assert bos not in llm_ids(llm, USER_CHAT, chat_template=template)
        assert ours.encode("x")[0] == bos
    # add_special_tokens: true on a chat asks for the tokenizer's bos too (vLLM: a second one)
    ids = server_ids(ours, {"messages": USER_CHAT, "add_special_tokens": True}, LLAMA31)
    assert ids[:2] == [bos, bos]


def test_chat_template_kwargs_reach_the_template(hf, ours, llm):
    for template, kwargs in ((QWEN3, {"enable_thinking": False}), (LLAMA31, {"date_string": "01 Jan 2025"}),
                             (LLAMA31, {"builtin_tools": ["brave_search", "wolfram_alpha"]})):
        expected = vllm_ids(hf, USER_CHAT, template, **kwargs)
        assert server_ids(ours, {"messages": USER_CHAT, "chat_template_kwargs": kwargs}, template) == expected
        assert llm_ids(llm, USER_CHAT, chat_template=template, chat_template_kwargs=kwargs) == expected
    thinking_off = ours.decode(server_ids(ours, {"messages": USER_CHAT, "chat_template_kwargs": {
        "enable_thinking": False}}, QWEN3), skip_special_tokens=False)
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_think_history_and_tool_responses(hf, ours, llm):
    messages = [{"role": "user", "content": "q1"},
                {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nanswer 1"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Lyon"}'}}, {"id": "c2", "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}]},
                {"role": "tool", "content": "rain", "tool_call_id": "c1"},
                {"role": "tool", "content": "snow", "tool_call_id": "c2"},
                {"role": "assistant", "content": "<think>\nnew thoughts\n</think>\n\nIt rains."}]
    expected = vllm_ids(hf, messages, QWEN3, tools=TOOLS, add_generation_prompt=False)
    body = {"messages": messages, "tools": TOOLS, "add_generation_prompt": False}
    assert server_ids(ours, body, QWEN3) == expected
    assert llm_ids(llm, messages, chat_template=QWEN3, tools=TOOLS, add_generation_prompt=False) == expected
    text = ours.decode(expected, skip_special_tokens=False)
    assert "old thoughts" not in text and "new thoughts" in text and '"arguments": {}' in text


def test_text_parts_joined_for_string_templates(hf, ours, llm):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    messages = [{"role": "user", "content": parts}]
    for template in (CHATML, QWEN3, LLAMA31):                # vLLM detects "string" for these: parts joined by \n
        expected = vllm_ids(hf, messages, template)
        assert server_ids(ours, {"messages": messages}, template) == expected
        assert llm_ids(llm, messages, chat_template=template) == expected
    assert "first\nsecond" in ours.decode(server_ids(ours, {"messages": messages}, CHATML))


def test_openai_content_format_flag(hf, ours):
    parts = [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "plain"}]
    expected = vllm_ids(hf, messages, GEMMA3, content_format="openai")
    assert server_ids(ours, {"messages": messages}, GEMMA3, content_format="openai") == expected


def test_chat_template_file_override(hf, ours, tmp_path):
    path = tmp_path / "phi3.jinja"
    path.write_text(PHI3, encoding="utf-8")
    template = load_chat_template(str(path))
    assert server_ids(ours, {"messages": SYSTEM_CHAT}, template) == vllm_ids(hf, SYSTEM_CHAT, PHI3)
    # without an override the model's own (ChatML) renders
    assert server_ids(ours, {"messages": SYSTEM_CHAT}, None) == vllm_ids(hf, SYSTEM_CHAT, CHATML)


def test_tojson_arguments_and_namespace_helpers(hf, ours, llm):
    tools = [{"type": "function", "function": {"name": "réponse", "description": "ü <tag> & \"q\"",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "ça va?", "name": "zoé"},
                {"role": "assistant", "content": "oui"}, {"role": "user", "content": "et toi?"}]
    expected = vllm_ids(hf, messages, MISC, tools=tools)
    assert server_ids(ours, {"messages": messages, "tools": tools}, MISC) == expected
    assert llm_ids(llm, messages, chat_template=MISC, tools=tools) == expected
    text = ours.decode(expected, skip_special_tokens=False)
    assert "\\u00e9" in text and "\n  " in text and "(zoé)" in text     # ensure_ascii=True, indent=2, name
    # a tool without description / parameters reaches the template as vLLM's tool.model_dump() (nulls), so
    # `tool | tojson` renders the same prompt
    bare = [{"type": "function", "function": {"name": "ping"}}]
    dumped = [{"type": "function", "function": {"name": "ping", "description": None, "parameters": None}}]
    assert server_ids(ours, {"messages": USER_CHAT, "tools": bare}, QWEN3) == \
        vllm_ids(hf, USER_CHAT, QWEN3, tools=dumped)


def test_reasoning_effort_sets_enable_thinking(hf, ours):
    expected = vllm_ids(hf, USER_CHAT, QWEN3, reasoning_effort="none", enable_thinking=False)
    assert server_ids(ours, {"messages": USER_CHAT, "reasoning_effort": "none"}, QWEN3) == expected


def test_template_errors_are_400_with_the_templates_message(ours, llm):
    error = server_error(ours, {"messages": SYSTEM_CHAT}, GEMMA)
    assert error.status == 400 and "System role not supported" in error.message
    error = server_error(ours, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                         MISTRAL_V03)
    assert error.status == 400 and "must alternate user/assistant" in error.message
    calls = tool_chat("short")              # Mistral's template checks 9-character ids
    error = server_error(ours, {"messages": calls, "tools": TOOLS}, MISTRAL_V03)
    assert "length 9" in error.message
    with pytest.raises(RequestError, match="System role not supported"):
        llm_ids(llm, SYSTEM_CHAT, chat_template=GEMMA)
    assert server_error(ours, {"messages": []}, CHATML).status == 400
    with pytest.raises(RequestError):
        llm_ids(llm, [], chat_template=CHATML)
    error = server_error(ours, {"messages": USER_CHAT[:2], "continue_final_message": True}, CHATML)
    assert error.status == 400          # with add_generation_prompt (default true)


def test_http_chat_and_tokenize(folder, hf):
    import httpx
    from server_testing import make_engine, running_server
    engine = make_engine(folder, max_model_len=2048, max_num_batched_tokens=2048, num_gpu_blocks_override=256)
    try:
        with running_server(engine, "tiny", chat_template=load_chat_template(GEMMA)) as (url, _):
            resp = httpx.post(f"{url}/v1/chat/completions", json={"messages": SYSTEM_CHAT, "max_tokens": 1}, timeout=60)
            assert resp.status_code == 400 and "System role not supported" in resp.json()["error"]["message"]
            resp = httpx.post(f"{url}/tokenize", json={"messages": USER_CHAT}, timeout=60)
            assert resp.status_code == 200 and resp.json()["tokens"] == vllm_ids(hf, USER_CHAT, GEMMA)
            resp = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER_CHAT, "max_tokens": 1}, timeout=60)
            assert resp.json()["usage"]["prompt_tokens"] == len(vllm_ids(hf, USER_CHAT, GEMMA))
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# divergences (xfail strict: each fails today)

ITERATING = ("{% for m in messages %}<{{ m.role }}>{% for part in m.content %}{{ part.text }}{% endfor %}"
             "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_auto_content_format_detects_openai_on_the_server(hf, ours):
    parts = [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}]
    assert server_ids(ours, {"messages": messages}, GEMMA3) == vllm_ids(hf, messages, GEMMA3, content_format="openai")


def test_auto_content_format_string_content_in_iterating_template(hf, ours):
    messages = [{"role": "user", "content": "hello"}]
    assert server_ids(ours, {"messages": messages}, ITERATING) == \
        vllm_ids(hf, messages, ITERATING, content_format="openai")


def test_llm_chat_auto_content_format(hf, llm):
    messages = [{"role": "user", "content": [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]}]
    assert llm_ids(llm, messages, chat_template=GEMMA3) == \
        vllm_ids(hf, messages, GEMMA3, content_format="openai", server=False)


def test_llm_chat_takes_chat_template_content_format(hf, llm):
    assert llm_ids(llm, USER_CHAT, chat_template=CHATML, chat_template_content_format="string") == \
        vllm_ids(hf, USER_CHAT, CHATML, server=False)


def test_server_reasoning_field_reaches_qwen3_history(hf, ours):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "my thoughts"}]
    expected = vllm_ids(hf, messages, QWEN3, add_generation_prompt=False)
    assert "my thoughts" in hf.decode(expected)
    assert server_ids(ours, {"messages": messages, "add_generation_prompt": False}, QWEN3) == expected


def test_server_reasoning_content_reaches_a_reasoning_template(hf, ours):
    template = "{% for m in messages %}[{{ m.role }}]{{ m.reasoning }}|{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "R"}]
    assert server_ids(ours, {"messages": messages, "add_generation_prompt": False}, template) == \
        vllm_ids(hf, messages, template, add_generation_prompt=False)


def test_llm_chat_reasoning_field(hf, llm):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "my thoughts"}]
    assert llm_ids(llm, messages, chat_template=QWEN3, add_generation_prompt=False) == \
        vllm_ids(hf, messages, QWEN3, server=False, add_generation_prompt=False)


def test_tokenizer_apply_chat_template_aliases_reasoning(hf, ours):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "T"}]
    assert ours.apply_chat_template(messages, False, chat_template=QWEN3) == \
        hf.apply_chat_template(messages, chat_template=QWEN3, tokenize=False)


def test_server_developer_role_becomes_system(hf, ours):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q"}]
    assert server_ids(ours, {"messages": messages}, QWEN25) == vllm_ids(hf, messages, QWEN25)


def test_llm_chat_developer_role_becomes_system(hf, llm):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                {"role": "developer", "content": "D"}]
    assert llm_ids(llm, messages, chat_template=LLAMA31) == vllm_ids(hf, messages, LLAMA31, server=False)


def test_server_custom_role_reaches_the_template(hf, ours):
    messages = [{"role": "user", "content": "run it"}, {"role": "ipython", "content": "42"}]
    assert server_ids(ours, {"messages": messages}, CHATML) == vllm_ids(hf, messages, CHATML)


def test_server_unknown_role_400_carries_the_templates_message(ours):
    template = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('unknown role: ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}")
    error = server_error(ours, {"messages": [{"role": "function", "content": "x"}]}, template)
    assert "unknown role: function" in error.message


def test_server_documents_reach_the_template(hf, ours):
    documents = [{"title": "Doc", "text": "body text"}]
    assert server_ids(ours, {"messages": USER_CHAT, "documents": documents}, MISC) == \
        vllm_ids(hf, USER_CHAT, MISC, documents=documents)


def test_llm_chat_tools_and_documents_in_chat_template_kwargs(hf, llm):
    documents = [{"title": "Doc", "text": "body text"}]
    assert llm_ids(llm, USER_CHAT, chat_template=MISC, chat_template_kwargs={"documents": documents}) == \
        vllm_ids(hf, USER_CHAT, MISC, server=False, documents=documents)
    assert llm_ids(llm, USER_CHAT, chat_template=QWEN3, chat_template_kwargs={"tools": TOOLS}) == \
        vllm_ids(hf, USER_CHAT, QWEN3, server=False, tools=TOOLS)


def test_named_tool_use_template_is_picked_with_tools(tmp_path):
    from transformers import AutoTokenizer
    source = build_folder(str(tmp_path / "src"))
    hf = AutoTokenizer.from_pretrained(source)
    hf.chat_template = {"default": "DEFAULT {{ messages[0].content }}",
                        "tool_use": "TOOLS {{ tools | length }} {{ messages[0].content }}"}
    saved = str(tmp_path / "saved")
    hf.save_pretrained(saved)           # transformers 5: chat_template.jinja + additional_chat_templates/tool_use.jinja
    build_folder(str(tmp_path / "cfg"), template=None)
    os.replace(str(tmp_path / "cfg" / "config.json"), os.path.join(saved, "config.json"))
    ours = load_tokenizer(saved)
    messages = [{"role": "user", "content": "x"}]
    reference = AutoTokenizer.from_pretrained(saved)
    assert ours.apply_chat_template(messages, tools=TOOLS) == reference.apply_chat_template(messages, tools=TOOLS,
                                                                                           tokenize=False)


def test_sep_cls_mask_tokens_reach_the_template(tmp_path):
    from transformers import AutoTokenizer
    folder = build_folder(str(tmp_path / "sep"), extra_config={"sep_token": "<|end|>", "cls_token": "<|system|>",
                                                               "mask_token": "<|user|>"})
    template = "{{ cls_token }}{% for m in messages %}{{ m.content }}{{ sep_token }}{% endfor %}{{ mask_token }}"
    messages = [{"role": "user", "content": "x"}]
    assert load_tokenizer(folder).apply_chat_template(messages, chat_template=template) == \
        AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, chat_template=template, tokenize=False)


def test_llm_chat_none_valued_keys(hf, llm):
    messages = [{"role": "user", "content": "hi", "name": None}]
    assert llm_ids(llm, messages, chat_template=MISC) == vllm_ids(hf, messages, MISC, server=False)


def test_server_text_like_parts(hf, ours):
    messages = [{"role": "user", "content": ["a", {"type": "input_text", "text": "b"}]}]
    assert server_ids(ours, {"messages": messages}, CHATML) == vllm_ids(hf, messages, CHATML)


def test_server_chat_template_in_kwargs_is_refused(ours):
    server_error(ours, {"messages": USER_CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, CHATML)


# follow-ups of a review of the fixes above ------------------------------------------------------------------
def test_server_developer_with_empty_content_keeps_an_empty_system_message(hf, ours):
    for messages in ([{"role": "developer", "content": ""}, {"role": "user", "content": "q"}],
                     [{"role": "system", "content": ""}, {"role": "user", "content": "q"},
                      {"role": "developer", "content": ""}]):
        assert server_ids(ours, {"messages": messages}, QWEN25) == vllm_ids(hf, messages, QWEN25), messages


def test_server_reasoning_wins_over_reasoning_content_and_stays_on_assistants(hf, ours):
    messages = [{"role": "user", "content": "q", "reasoning": "U"},
                {"role": "assistant", "content": "a", "reasoning": "AAA", "reasoning_content": "BBB"},
                {"role": "user", "content": "q2"}]
    assert server_ids(ours, {"messages": messages}, QWEN3) == vllm_ids(hf, messages, QWEN3)


def test_documents_through_chat_template_kwargs_must_be_objects(llm):
    with pytest.raises(RequestError, match="documents must be a list of objects"):
        llm_ids(llm, USER_CHAT, chat_template=MISC, chat_template_kwargs={"documents": "not a list"})
