"""TieredConnector on Ray Serve LLM: the connector backend Ray runs in each replica (`backend`, with
`stores`, which decides each replica's store address, ports and secret), the Serve config of the P/D
app on CPU (`serve_pd_cpu.yaml`), the KubeRay RayService template whose serveConfigV2 is that config
(`rayservice.yaml`), its GPU overlay (`rayservice_gpu_overlay.yaml`), `manifests`, which renders
either variant, and `testapp`, that config as the Ray tests deploy it. kvconnectors.ray registers the
backend with Ray. See README.md."""
