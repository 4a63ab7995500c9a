//! An agent's tools as its keel.toml tables give them, one group per table, kept so that when an
//! MCP server lists other tools (it sent `notifications/tools/list_changed`, or it was started
//! again) the agent gets the tools of every table again, in their order, with that server's new
//! ones.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use keel_core::agent::WeakAgents;
use keel_core::tool::{Tool, ToolRegistry};

/// The tools one table gives.
type Group = Vec<Arc<dyn Tool>>;

pub struct ToolGroups {
    agent: String,
    /// By the table's place in the agent's list; `None` for a table not built yet.
    groups: Mutex<Vec<Option<Group>>>,
    /// Set once the server's agents exist (the first listing comes before them).
    agents: OnceLock<WeakAgents>,
    /// A list changed before the agents existed: they get the groups when attached.
    missed: AtomicBool,
}

impl ToolGroups {
    pub fn new(agent: &str) -> Arc<Self> {
        Arc::new(Self {
            agent: agent.to_owned(),
            groups: Mutex::new(Vec::new()),
            agents: OnceLock::new(),
            missed: AtomicBool::new(false),
        })
    }

    /// The tools table `index` was built with — unless its server announced a newer list while it
    /// was being built, which stays.
    pub fn built(&self, index: usize, tools: Vec<Arc<dyn Tool>>) {
        at(&mut self.lock(), index).get_or_insert(tools);
    }

    /// The agents to give a new tool set to; if a list changed while the server started, the
    /// groups as they are now go to them at once.
    pub fn attach(&self, agents: WeakAgents) {
        if self.agents.set(agents).is_ok() && self.missed.load(Ordering::SeqCst) {
            self.apply();
        }
    }

    /// Table `index`'s server listed `tools`: the agent gets the new set.
    pub fn replace(&self, index: usize, tools: Vec<Arc<dyn Tool>>) {
        *at(&mut self.lock(), index) = Some(tools);
        self.apply();
    }

    fn apply(&self) {
        match self.agents.get() {
            Some(agents) => self.apply_to(agents),
            None => {
                self.missed.store(true, Ordering::SeqCst);
                // Attached meanwhile, perhaps before the flag was up: this one gives the agents the set.
                if let Some(agents) = self.agents.get() {
                    self.apply_to(agents);
                }
            }
        }
    }

    fn apply_to(&self, agents: &WeakAgents) {
        let Some(agents) = agents.upgrade() else { return };
        // A new tool whose name another table's tool has is left out, and said so; the rest stay.
        let mut registry = ToolRegistry::new();
        for tool in self.lock().iter().flatten().flatten() {
            if let Err(e) = registry.register(tool.clone()) {
                tracing::warn!(agent = %self.agent, error = %e, "a tool of the new list is left out");
            }
        }
        let names = registry.names().count();
        agents.set_tools(&self.agent, registry);
        tracing::info!(agent = %self.agent, tools = names, "the agent's tools changed");
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<Group>>> {
        self.groups.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Group `index`, the list grown to hold it.
fn at(groups: &mut Vec<Option<Group>>, index: usize) -> &mut Option<Group> {
    if groups.len() <= index {
        groups.resize_with(index + 1, || None);
    }
    &mut groups[index]
}
