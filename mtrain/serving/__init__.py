"""`mtrain serve`: text generation over HTTP.

    http.py          the Flask application and its routes, error shapes, start and clean stop
    body.py          a request body's bytes -> JSON, refusing what is not plain JSON (depth, NaN, surrogates)
    fields.py        the checks every field of a request goes through (BadRequest names the field)
    megatron_api.py  PUT /api, as Megatron-LM's text generation server answers it
    openai_api.py    /v1/completions, /v1/chat/completions, /v1/models: OpenAI's protocol
    chat_template.py the tokenizer's chat template, rendered in a sandbox
    text.py          a row's text as its tokens arrive: stop strings, incomplete characters held back
    scheduler.py     the one thread that runs the model: requests batched and interleaved step by step
"""
