//! Agents: what a conversation talks to — a model, the tools it may call (each with its approval
//! policy), a system prompt and a context budget. A server runs several; each conversation keeps
//! the agent it was created with, and a run sees only its agent's tools and prompt.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, Weak};

use serde::{Deserialize, Serialize};

use crate::context::ContextConfig;
use crate::domain::UserRole;
use crate::model::Model;
use crate::tool::{Policy, ToolRegistry};

pub struct Agent {
    pub id: String,
    pub name: String,
    pub description: String,
    pub model: Arc<dyn Model>,
    pub tools: ToolRegistry,
    /// The system prompt and the context budget.
    pub context: ContextConfig,
    /// Prompts a client may offer to start a conversation with.
    pub suggestions: Vec<String>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("id", &self.id)
            .field("model", &self.model.name())
            .field("tools", &self.tools.names().collect::<Vec<_>>())
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    #[error("agent id {0:?}: must be 1 to 64 of [a-z0-9_-], starting with a letter or digit")]
    BadId(String),
    #[error("two agents have the id {0:?}")]
    Duplicate(String),
}

/// Whether `id` can name an agent: `[a-z0-9][a-z0-9_-]{0,63}`.
pub fn valid_agent_id(id: &str) -> bool {
    let mut bytes = id.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z' | b'0'..=b'9'))
        && id.len() <= 64
        && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-'))
}

impl Agent {
    /// An agent with no tools and the default context settings but for its system prompt.
    pub fn new(id: &str, name: &str, model: Arc<dyn Model>, system_prompt: &str) -> Result<Self, AgentError> {
        if !valid_agent_id(id) {
            return Err(AgentError::BadId(crate::mask::truncate(id, 80)));
        }
        Ok(Self {
            id: id.to_owned(),
            name: name.to_owned(),
            description: String::new(),
            model,
            tools: ToolRegistry::new(),
            context: ContextConfig { system_prompt: system_prompt.to_owned(), ..ContextConfig::default() },
            suggestions: Vec::new(),
        })
    }

    pub fn description(mut self, description: &str) -> Self {
        self.description = description.to_owned();
        self
    }

    pub fn suggestions(mut self, suggestions: Vec<String>) -> Self {
        self.suggestions = suggestions;
        self
    }

    pub fn tools(mut self, tools: ToolRegistry) -> Self {
        self.tools = tools;
        self
    }

    pub fn context(mut self, context: ContextConfig) -> Self {
        self.context = context;
        self
    }

    /// What `GET /v1/agents` shows of it.
    pub fn info(&self, default: bool) -> AgentInfo {
        AgentInfo {
            id: self.id.clone(),
            name: self.name.clone(),
            description: self.description.clone(),
            default,
            suggestions: self.suggestions.clone(),
            tools: self
                .tools
                .specs()
                .iter()
                .map(|t| ToolInfo {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    side_effect: t.side_effect,
                    idempotent: t.idempotent,
                    policies: t.policies.clone(),
                })
                .collect(),
        }
    }
}

/// The agents of a server, by id, one of them the default (for conversations that name none, and
/// those made before agents).
///
/// The set of agents is fixed when the server starts; an agent's tools may change while it runs
/// (an MCP server announces a new tool list: [`Agents::set_tools`]). A run works with the agent as
/// it was when its worker took the run, until the run pauses or ends: a tool set never changes
/// under a step, and a resumed run sees the tools of the moment it is resumed.
#[derive(Debug, Clone)]
pub struct Agents {
    /// In the order they were given (`GET /v1/agents` lists them so).
    list: Arc<RwLock<Vec<Arc<Agent>>>>,
    by_id: Arc<BTreeMap<String, usize>>,
    default_id: String,
}

/// A handle on [`Agents`] that does not keep them alive: for the tools an agent holds, which
/// would otherwise keep their own agent alive.
#[derive(Debug, Clone)]
pub struct WeakAgents {
    list: Weak<RwLock<Vec<Arc<Agent>>>>,
    by_id: Arc<BTreeMap<String, usize>>,
    default_id: String,
}

impl WeakAgents {
    pub fn upgrade(&self) -> Option<Agents> {
        Some(Agents { list: self.list.upgrade()?, by_id: self.by_id.clone(), default_id: self.default_id.clone() })
    }
}

impl Agents {
    /// A server with one agent, the default.
    pub fn single(agent: Agent) -> Self {
        let default_id = agent.id.clone();
        Self {
            list: Arc::new(RwLock::new(vec![Arc::new(agent)])),
            by_id: Arc::new(BTreeMap::from([(default_id.clone(), 0)])),
            default_id,
        }
    }

    /// The agents in this order; the default is the one `default` names, or the first.
    pub fn new(agents: Vec<Agent>, default: Option<&str>) -> Result<Self, AgentError> {
        let mut by_id = BTreeMap::new();
        for (i, agent) in agents.iter().enumerate() {
            if by_id.insert(agent.id.clone(), i).is_some() {
                return Err(AgentError::Duplicate(agent.id.clone()));
            }
        }
        let default_id = match default {
            Some(id) if by_id.contains_key(id) => id.to_owned(),
            Some(id) => return Err(AgentError::BadId(id.to_owned())),
            None => agents.first().map(|a| a.id.clone()).ok_or_else(|| AgentError::BadId(String::new()))?,
        };
        let list = agents.into_iter().map(Arc::new).collect();
        Ok(Self { list: Arc::new(RwLock::new(list)), by_id: Arc::new(by_id), default_id })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Agent>>> {
        // Only `set_tools` writes, and it cannot panic while holding the lock.
        self.list.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Arc<Agent>> {
        self.by_id.get(id).map(|&i| self.read()[i].clone())
    }

    pub fn default_agent(&self) -> Arc<Agent> {
        self.read()[self.by_id[&self.default_id]].clone()
    }

    pub fn default_id(&self) -> &str {
        &self.default_id
    }

    /// The agent a conversation or run names, or the default for one that names none.
    pub fn resolve(&self, id: Option<&str>) -> Option<Arc<Agent>> {
        match id {
            Some(id) => self.get(id),
            None => Some(self.default_agent()),
        }
    }

    /// The agents, in their order, as they are now.
    pub fn all(&self) -> Vec<Arc<Agent>> {
        self.read().clone()
    }

    /// What `GET /v1/agents` lists.
    pub fn infos(&self) -> Vec<AgentInfo> {
        self.all().iter().map(|a| a.info(a.id == self.default_id)).collect()
    }

    /// Gives agent `id` these tools from now on: the runs taken (started, resumed, recovered) after
    /// this see them; a run being worked on keeps the tools it was taken with until it pauses or
    /// ends. `false` if there is no such agent.
    pub fn set_tools(&self, id: &str, tools: ToolRegistry) -> bool {
        let Some(&i) = self.by_id.get(id) else { return false };
        let mut list = self.list.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        let old = &list[i];
        let agent = Agent {
            id: old.id.clone(),
            name: old.name.clone(),
            description: old.description.clone(),
            model: old.model.clone(),
            tools,
            context: old.context.clone(),
            suggestions: old.suggestions.clone(),
        };
        list[i] = Arc::new(agent);
        true
    }

    pub fn downgrade(&self) -> WeakAgents {
        WeakAgents { list: Arc::downgrade(&self.list), by_id: self.by_id.clone(), default_id: self.default_id.clone() }
    }
}

/// An agent as clients see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentInfo {
    pub id: String,
    pub name: String,
    pub description: String,
    /// Conversations that name no agent talk to this one.
    pub default: bool,
    /// Prompts a client may offer to start a conversation with.
    pub suggestions: Vec<String>,
    pub tools: Vec<ToolInfo>,
}

/// A tool as clients see it: what it does and who may run it how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ToolInfo {
    pub name: String,
    pub description: String,
    pub side_effect: bool,
    pub idempotent: bool,
    /// The policy per role (`allow`, `ask`, `deny`); a role not listed is denied.
    #[cfg_attr(feature = "openapi", schema(value_type = BTreeMap<String, Policy>))]
    pub policies: BTreeMap<UserRole, Policy>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelError, ModelRequest, ModelStream};

    struct Silent;

    #[async_trait::async_trait]
    impl Model for Silent {
        fn name(&self) -> &str {
            "silent"
        }
        async fn stream(&self, _: ModelRequest) -> Result<ModelStream, ModelError> {
            Ok(Box::pin(futures::stream::empty()))
        }
    }

    fn agent(id: &str) -> Agent {
        Agent::new(id, id, Arc::new(Silent), "prompt").unwrap()
    }

    #[test]
    fn ids_are_checked_and_unique() {
        assert!(valid_agent_id("ops"));
        assert!(valid_agent_id("a-1_b"));
        for bad in ["", "Ops", "-x", "a b", &"x".repeat(65)] {
            assert!(!valid_agent_id(bad), "{bad}");
        }
        assert!(Agent::new("Bad Id", "x", Arc::new(Silent), "p").is_err());
        assert_eq!(Agents::new(vec![agent("a"), agent("a")], None).unwrap_err(), AgentError::Duplicate("a".into()));
    }

    #[test]
    fn the_default_is_named_or_first() {
        let agents = Agents::new(vec![agent("a"), agent("b")], None).unwrap();
        assert_eq!(agents.default_id(), "a");
        assert_eq!(agents.resolve(None).unwrap().id, "a");
        assert_eq!(agents.resolve(Some("b")).unwrap().id, "b");
        assert!(agents.resolve(Some("c")).is_none());
        let agents = Agents::new(vec![agent("a"), agent("b")], Some("b")).unwrap();
        assert_eq!(agents.default_id(), "b");
        assert!(agents.infos().iter().any(|i| i.id == "b" && i.default));
        assert!(Agents::new(vec![agent("a")], Some("zzz")).is_err());
    }

    #[test]
    fn new_tools_are_seen_by_later_lookups_not_by_an_agent_already_taken() {
        let agents = Agents::new(vec![agent("a"), agent("b")], None).unwrap();
        let taken = agents.get("a").unwrap();
        let weak = agents.downgrade();
        struct Added(crate::tool::ToolSpec);
        #[async_trait::async_trait]
        impl crate::tool::Tool for Added {
            fn spec(&self) -> &crate::tool::ToolSpec {
                &self.0
            }
            async fn execute(
                &self,
                _: &crate::tool::ToolContext,
                _: &serde_json::Value,
            ) -> Result<crate::tool::ToolOutput, crate::tool::ToolError> {
                Ok(crate::tool::ToolOutput::default())
            }
        }
        let spec = crate::tool::ToolSpec::new("added", "added", serde_json::json!({"type": "object"}), false);
        let tool: Arc<dyn crate::tool::Tool> = Arc::new(Added(spec));
        assert!(weak.upgrade().unwrap().set_tools("a", ToolRegistry::new().with(tool)));
        assert_eq!(agents.get("a").unwrap().tools.names().collect::<Vec<_>>(), ["added"]);
        assert_eq!(taken.tools.names().count(), 0);
        assert_eq!(agents.infos()[0].tools.len(), 1);
        assert_eq!(agents.get("b").unwrap().tools.names().count(), 0);
        assert!(!agents.set_tools("zzz", ToolRegistry::new()));
        drop(agents);
        assert!(weak.upgrade().is_none());
    }
}
