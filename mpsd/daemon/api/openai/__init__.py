"""OpenAI's API over the repository's models: the daemon's third protocol adapter, on the HTTP server
(`api.web.Mount`) or a port of its own.

A model opts in with the `openai` section of its config, naming the inputs and outputs that carry its
endpoint's fields; a request becomes the inference call KServe's adapters make (`api.call`) and goes through
`Operations.infer` or `Operations.stream`, so loading on demand, batching, queues, statistics and access
apply unchanged. `routes` maps the paths, `models` lists the models, `embeddings`, `generation` (chat and
completions) and `transcription` translate, `fields` reads request bodies, `errors` writes OpenAI's error
body, `stats` counts requests for the metrics.
"""
