"""Engines behind SGLang's native HTTP API: the client (:mod:`.client`, request schemas in
:mod:`.protocol`), the engine over one or more servers (:mod:`.engine`, fault tolerance in
:mod:`.recovery` and :mod:`.snapshot`), the server processes (:mod:`.processes`), starting them
from a config (:mod:`.start`) and their API keys (:mod:`.auth`)."""
