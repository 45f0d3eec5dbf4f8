# The README's two commands: `make run` and `make test`; the rest are for deployments.
.PHONY: setup run test protos image compose-up compose-down test-deploy

COMPOSE = .venv/bin/podman-compose -f deploy/compose.yaml --env-file deploy/.env

setup:
	bash scripts/setup.sh

# On a laptop's CPU one node that prefills and decodes, with its weights in half
# precision, is the fast path (README, "On the CPU"); --prefill 1 --decode 1 (the
# default without these flags) shows disaggregation.
run: setup
	.venv/bin/tandem up --colocated 1 --cpu-weights auto

test: setup
	bash scripts/test.sh

protos: setup
	.venv/bin/python -m tandem.protos.generate

# The CPU image (and on a machine with no registry, the base and Redis images too).
image: setup
	bash deploy/build.sh all

# The compose stack on this machine: the router on 127.0.0.1:8000, secrets in deploy/.env.
compose-up: image
	$(COMPOSE) up -d
	@echo "router: http://127.0.0.1:$$(grep '^TANDEM_PORT=' deploy/.env | cut -d= -f2)/v1 (API key: TANDEM_API_KEY in deploy/.env)"

compose-down:
	$(COMPOSE) down

# The container tests: the image, the compose stack and the Helm chart.
test-deploy: setup
	bash scripts/test.sh -m deploy
