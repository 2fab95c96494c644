"""Text: what the server and the engine share between strings and token ids (no torch).

- tokenizer.py: Tokenizer (tokenizer.json + tokenizer_config.json), load_tokenizer
- chat_template.py: the model's (or --chat-template's) Jinja chat template, rendered sandboxed and bounded
- detokenizer.py: IncrementalDetokenizer, one request's output text token by token, with stop strings
- generation_config.py: generation_config.json's EOS ids and default sampling params
"""
