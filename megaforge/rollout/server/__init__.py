"""megaforge's embedded engine behind SGLang's native HTTP API.

    python -m megaforge.rollout.server --model DIR --port P [--host 127.0.0.1] [--api-key K]
        [--tokenizer DIR] [--device cpu] [--dtype float32] [--log-file F] [--weight-version V]
        [--generate-delay S]

Endpoints (request/answer fields as sglang 0.5.23; schemas in :mod:`megaforge.rollout.http.protocol`):
``/generate``, ``/update_weights_from_tensor``, ``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
``/begin_weight_update``, ``/end_weight_update``, ``/update_weight_version``,
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/flush_cache``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``, ``/health``, ``/health_generate``, ``/get_weight_version``,
``/model_info`` (= ``/get_model_info``), ``/server_info`` (= ``/get_server_info``), ``/get_weights_by_name``;
megaforge's own ``/get_weights_checksum`` (per-tensor sha256, for ``sync.check_equal``). OpenAI-compatible:
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (:mod:`megaforge.rollout.server.openai_api`).

Bounds (:mod:`megaforge.rollout.server.limits`), as SGLang: a prompt of at least the model's context
``C`` tokens, or prompt + ``max_new_tokens`` beyond ``C``, is HTTP 400 with SGLang's message; a text
that cannot fit ``C`` is refused before it is tokenized; sampling values must be finite and in range
(temperature >= 0, below 1e-6 greedy; top_p in (0, 1]; top_k -1 or >= 1). Connections: open-file
limit raised to the hard one, at most ``--max-connections`` open (the oldest idle one is closed at
the limit), ``--idle-timeout`` for a request head, ``--body-timeout`` for a body, at most
``--max-body-readers`` requests waiting for a body at once (503 beyond). A request whose client closes
its connection is dropped while queued and aborted while running. ``/health_generate``
is 200 only when the engine makes a decoding step within ``--health-timeout``;
``/init_weights_update_group`` runs off the engine thread and reaches its store within
``--dist-connect-timeout``.

Checked state, as SGLang: tensor and distributed weight updates run inside a
``/begin_weight_update`` .. ``/end_weight_update`` session; memory tags are released and resumed
once each (generating or loading weights while ``weights`` is released is an error); memory release
and a flushing update need an idle server. A malformed body (unknown field, wrong type) is HTTP 400
``{"object": "error", "message", "type": "Bad Request", "param": <field>, "code": 400}``.

Security: binds 127.0.0.1 by default and refuses a non-loopback bind without an API key
(``--api-key`` or ``$MEGAFORGE_ENGINE_API_KEY``, which keeps it out of ``ps``). With a key every
endpoint except ``/health*`` needs ``Authorization: Bearer <key>`` (SGLang's ``--api-key`` rule), else
401. ``/update_weights_from_disk`` reads only under ``--weight-root`` directories when any is given, and
nothing when bound beyond loopback without one (403); it checks every file and tensor before the
first weight changes (:mod:`megaforge.rollout.server.weights`). Weight payloads are unpickled with
:mod:`megaforge.sync.unpickle` (allowlist :mod:`megaforge.sync.tensor_payload`, at most 2**20 opcodes) on a
decoding thread of their own: a large or hostile payload does not hold generation.
"""

