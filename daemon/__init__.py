"""The loadmesh agent: configuration, components, local API and CLI."""
