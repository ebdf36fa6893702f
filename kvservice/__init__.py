"""Process plumbing shared by every long-running kvroute process (router, agent, simulated engine).

One logging set-up (:mod:`kvservice.logs`: ``--log-level``, ``--log-format {text,json}``) and one
lifecycle (:mod:`kvservice.lifecycle`: clean start-up errors, serve until SIGTERM/SIGINT). It
imports nothing from the project, so every package may import it.
"""
