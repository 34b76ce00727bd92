"""The OpenAI Batch API: files (api/batch/files.py), batch records (model.py), input lines (lines.py), the API's
side (service.py) and the runner that executes a batch as an RQ job on a batch worker (runner.py)."""
