"""Deployment: the docker-compose generator (`python -m deploy.compose`); see docs/deploy.md."""
