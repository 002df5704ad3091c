"""Suite-wide set-up.

The tests configure OpenTelemetry themselves: a variable such as OTEL_TRACES_SAMPLER or
OTEL_EXPORTER_OTLP_ENDPOINT in the runner's environment would otherwise change what the traced
app records, and reach the servers the tests start as subprocesses. Tests that read these
variables set them with monkeypatch.
"""

import os

for _name in [name for name in os.environ if name.startswith("OTEL_")]:
    del os.environ[_name]
