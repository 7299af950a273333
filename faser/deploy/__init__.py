"""Deployment artefacts rendered from the serving code: KubeRay manifests for GPU clusters.

This sits at the top of the stack beside the CLI: it imports `deployments` (and so Ray Serve) to
build the application exactly as `serve build` does; nothing in the core imports it.
"""
