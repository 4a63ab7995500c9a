//! An agent's tools as its keel.toml tables give them, one group per table, kept so that when an
//! MCP server lists other tools (it sent `notifications/tools/list_changed`, or it was started
//! again) the agent gets the tools of every table again, in their order, with that server's new
//! ones.

use std::sync::{Arc, Mutex, OnceLock};

use keel_core::agent::WeakAgents;
use keel_core::tool::{Tool, ToolRegistry};

pub struct ToolGroups {
    agent: String,
    groups: Mutex<Vec<Vec<Arc<dyn Tool>>>>,
    /// Set once the server's agents exist (the first listing comes before them).
    agents: OnceLock<WeakAgents>,
}

impl ToolGroups {
    pub fn new(agent: &str) -> Arc<Self> {
        Arc::new(Self { agent: agent.to_owned(), groups: Mutex::new(Vec::new()), agents: OnceLock::new() })
    }

    /// Adds the next table's group; its index, for [`ToolGroups::replace`].
    pub fn push(&self, tools: Vec<Arc<dyn Tool>>) -> usize {
        let mut groups = self.lock();
        groups.push(tools);
        groups.len() - 1
    }

    /// Every group's tools, in order; a tool whose name another took first is refused.
    pub fn registry(&self) -> Result<ToolRegistry, keel_core::tool::RegistryError> {
        let mut registry = ToolRegistry::new();
        for tool in self.lock().iter().flatten() {
            registry.register(tool.clone())?;
        }
        Ok(registry)
    }

    /// The agents to give a new tool set to; the groups as they are now go to them at once (a list
    /// may have changed while the server started).
    pub fn attach(&self, agents: WeakAgents) {
        if self.agents.set(agents).is_ok() {
            self.apply();
        }
    }

    /// Group `index` is now `tools`: the agent gets the new set.
    pub fn replace(&self, index: usize, tools: Vec<Arc<dyn Tool>>) {
        if let Some(group) = self.lock().get_mut(index) {
            *group = tools;
        }
        self.apply();
    }

    fn apply(&self) {
        let Some(agents) = self.agents.get().and_then(WeakAgents::upgrade) else { return };
        // A new tool whose name another table's tool has is left out, and said so; the rest stay.
        let mut registry = ToolRegistry::new();
        for tool in self.lock().iter().flatten() {
            if let Err(e) = registry.register(tool.clone()) {
                tracing::warn!(agent = %self.agent, error = %e, "a tool of the new list is left out");
            }
        }
        let names = registry.names().count();
        agents.set_tools(&self.agent, registry);
        tracing::info!(agent = %self.agent, tools = names, "the agent's tools changed");
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Vec<Arc<dyn Tool>>>> {
        self.groups.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
