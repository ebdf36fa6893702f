# The kvroute image: routers, endpoint pickers, agents and simulated engines all run from it
# (compose.yaml, deploy/kubernetes/).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvindex kvindex
COPY kvservice kvservice
COPY kvtokens kvtokens
COPY kvevents kvevents
COPY kvroute kvroute
COPY router router
COPY worker_agent worker_agent
COPY sim_engine sim_engine
COPY lua lua
RUN pip install --no-cache-dir ".[epp]"
# The services run as a user of their own, not root: they read their compose secrets (mode 644,
# secrets/create.sh) and write nothing but their home's caches.
RUN useradd --system --create-home --uid 10001 kvroute
USER kvroute
ENTRYPOINT []
