"""Deployment files. Installed as the package `tandem.deploy` for one of them: serve_config.yaml,
the default Serve config that `tandem deploy` reads wherever it runs (cli/serve_config.py)."""
