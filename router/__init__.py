"""The kvroute router (issue 4/6): stateless aiohttp replicas that read the shared index."""
