# llm-gateway: multi-stage build, slim runtime, non-root, health-checked.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY loadtest ./loadtest
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 gateway
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY deploy/examples/gateway.yaml /etc/llm-gateway/gateway.yaml
USER gateway
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"
ENTRYPOINT ["llm-gateway", "serve"]
CMD ["--config", "/etc/llm-gateway/gateway.yaml", "--host", "0.0.0.0", "--port", "8080"]
