"""Model services: the policy or a judge as an OpenAI-compatible completions service (Ray Serve, or one plain process
per Kubernetes pod), the client the stages call it with, and the Kubernetes manifests that deploy it."""
