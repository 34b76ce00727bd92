# The gaggle image: API, GPU worker and batch worker (compose.yaml picks the command).
# PyTorch from PyPI brings its CUDA runtime; the host's NVIDIA driver comes in through the container toolkit.
FROM python:3.12-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api ./api
COPY worker ./worker
COPY engine ./engine
COPY cli ./cli
COPY benchmarks ./benchmarks
COPY dashboards ./dashboards
RUN pip install --upgrade pip && pip install torch==2.13.0 && pip install -e .
ENTRYPOINT ["gaggle", "--log-format", "json", "--log-level", "INFO"]
CMD ["up", "--host", "0.0.0.0"]
